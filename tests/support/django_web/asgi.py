"""The project's ASGI entry point: Django, with the web view mounted at /ops/locks/ for
staff members signed in with Django's own login."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.support.django_web.settings")

import django  # noqa: E402

django.setup()

from importlib import import_module  # noqa: E402

from asgiref.sync import sync_to_async  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.auth import SESSION_KEY, get_user_model  # noqa: E402
from django.core.asgi import get_asgi_application  # noqa: E402
from django.core.management import call_command  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Mount  # noqa: E402

from celery_exclusive.web import create_app  # noqa: E402

# The test's own database: made here, with a staff member and a plain user.
call_command("migrate", verbosity=0)
User = get_user_model()
if not User.objects.filter(username="ana").exists():
    User.objects.create_user("ana", password="ana-password", is_staff=True)
    User.objects.create_user("bob", password="bob-password")


@sync_to_async
def staff_member(request):
    """Django's session decides: the staff member's user name, or None (refused)."""
    engine = import_module(settings.SESSION_ENGINE)
    session = engine.SessionStore(request.cookies.get(settings.SESSION_COOKIE_NAME))
    user_id = session.get(SESSION_KEY)
    user = User.objects.filter(pk=user_id, is_active=True, is_staff=True).first()
    return None if user is None else user.get_username()


application = Starlette(
    routes=[
        Mount(
            "/ops/locks",
            create_app(
                settings.CELERY_EXCLUSIVE_BACKEND_URL,
                release_token=os.environ.get("EXCLUSIVE_TEST_TOKEN"),
                identify=staff_member,
            ),
        ),
        Mount("/", get_asgi_application()),
    ]
)
