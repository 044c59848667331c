"""The per-job coordinator: embeddings, final norm, LM head, tokenizer and sampling, driving
the forward pass through the stages over WebSockets. Its KV cache lives on the stages."""
