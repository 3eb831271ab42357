"""The OpenAI-compatible HTTP API, by layer: protocol (the requests, as pydantic models) ->
parse (what only the model can check) -> serving (leases, starting choices, whole or streamed
replies) -> shapes (reply objects and chunks); bridge (engine thread -> event loop); errors
(UserError -> OpenAI's error body, once); routes (FastAPI routes, build_router, create_app,
serve); in_thread (the API served from a thread). Imports models and below."""
