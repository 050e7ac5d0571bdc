"""The OpenAI-compatible HTTP server (`pagedserve serve`): see `api_server.build_app`."""
