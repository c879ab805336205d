"""skiptrain.elastic"""
