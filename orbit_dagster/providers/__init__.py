"""GPU-rental providers behind one protocol (see base.py); chosen by `backend_key`."""
