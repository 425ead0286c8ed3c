"""The router service: answers submit and cancel requests, committing before it replies."""
