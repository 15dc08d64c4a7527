"""slime.agent"""
