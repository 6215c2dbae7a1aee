"""The web console: server-rendered pages under ``/console`` (docs/console.md).

Routes are thin, like the API's: they call the same services with the same
``Principal``; the only logic here is presentation (grids, charts, forms)."""
