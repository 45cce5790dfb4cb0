"""Serving: OpenAI's HTTP API over a Genie dialog config (`quiver serve`, extra `quiver[serve]`)."""
