"""Chat: the conversation, its context policies, the session, persistence and the terminal front end."""
