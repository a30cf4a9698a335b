"""Requests' state machines and the drivers that run them."""
