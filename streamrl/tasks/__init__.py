"""Built-in tasks: a prompt source and an exact, verifiable reward."""
