"""Anthropic's Messages API, translated onto the chat path."""
