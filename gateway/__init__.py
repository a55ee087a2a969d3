"""The gateway: the public text-level entry point of specdec.

Tokenizes prompts and chats, validates limits, routes each request to a draft/target pair (falling back to the
target's plain Generate when the draft is unavailable) and streams detokenized text back. See docs/gateway.md.
"""
