"""skiptrain.data"""
