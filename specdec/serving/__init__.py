"""Running a synchronous engine behind an asyncio service (no gRPC here)."""
