"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}), run as the equivalent chat.

A Responses body is translated into a chat completion and started through the one chat handler, so
the prompt, the tokens and the runtime block are those of that chat completion; only the framing differs.
"""
