"""`passkey` and `passkey_ll`: passkey retrieval by context length and insertion depth."""
