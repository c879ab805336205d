"""skiptrain.model"""
