"""slime.observability"""
