"""Built-in plugins: filters, GPU-choosing reserve plugins and the placement policies."""
