"""skiptrain.schedule"""
