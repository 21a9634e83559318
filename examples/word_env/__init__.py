"""`word`: an example of a user-defined environment (see word_env.py)."""
