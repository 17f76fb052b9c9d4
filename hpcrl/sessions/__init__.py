"""Multi-turn sessions with token-in/token-out (TITO): the session server, model families, tools, environments.

The server owns tokenization: turn 1 is rendered with a registered model family's template, later turns reuse the
stored token ids and tokenize only the appended messages, and every sampled token keeps its log-prob and weight
version, so the tokens trained on are exactly the tokens sampled. docs/multiturn.md says what exists.
"""
