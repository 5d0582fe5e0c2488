"""Serving: an OpenAI-compatible streaming server for voice bots, and a terminal client."""
