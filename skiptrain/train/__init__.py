"""skiptrain.train"""
