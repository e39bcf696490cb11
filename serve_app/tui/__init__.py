"""`tensorfold tui`: readings.py (what a poll shows), client.py (the server over HTTP), app.py (the screens)."""
