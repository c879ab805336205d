"""skiptrain.net"""
