"""Lazy image pulling: the eStargz format (toc, footer, estargz) and the node side."""
