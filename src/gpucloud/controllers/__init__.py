"""Leased background loops of the server: scheduling and node leases."""
