"""The REST API: thin FastAPI routers over services/."""
