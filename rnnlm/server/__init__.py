"""The async mode's parameter server and the authenticated wire it serves on (no Spark here)."""
