"""skiptrain.runtime"""
