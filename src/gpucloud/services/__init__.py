"""Business rules; the only writers of the database. One module per aggregate."""
