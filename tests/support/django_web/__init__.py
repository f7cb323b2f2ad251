"""A Django project that serves the web view under its own login, as its docs show:
Django's ASGI application and the view mounted side by side, the view asking Django's
session who is there (staff only).

EXCLUSIVE_TEST_STORE   lease store URL
EXCLUSIVE_TEST_DB      the SQLite file of Django's own database
"""
