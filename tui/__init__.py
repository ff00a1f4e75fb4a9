"""The Textual admin app (issue 8)."""
