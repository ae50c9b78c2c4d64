"""The engine core: the step loop, the scheduler, requests and their updates."""
