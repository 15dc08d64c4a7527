"""slime.rollout"""
