"""skiptrain.checkpoint"""
