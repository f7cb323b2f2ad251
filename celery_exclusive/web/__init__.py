"""A live web view of leases, lines of waiters and duplicates, for operators.

``celery -A proj exclusive web`` (or ``celery-exclusive --backend URL web``) serves it;
:func:`create_app` gives the same page as an ASGI application to mount inside your own
(FastAPI, Starlette, Django's ASGI, Flask through an ASGI-to-WSGI adapter), behind
your own authentication. It needs the ``web`` extra: ``pip install
'celery-exclusive[web]'``.
"""

from .app import create_app, default_identify

__all__ = ["create_app", "default_identify"]
