"""slime.ray"""
