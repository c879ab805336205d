"""skiptrain.dp"""
