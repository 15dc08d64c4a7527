"""slime.backends"""
