"""Generation: sampling, the token stream, the chat session, prefix reuse, token read-back."""
