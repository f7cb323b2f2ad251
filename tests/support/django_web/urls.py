from django.contrib.auth import authenticate, login
from django.http import HttpResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt


@csrf_exempt
def sign_in(request):
    """The project's own login (a form post): Django checks the password."""
    user = authenticate(
        request, username=request.POST.get("username"), password=request.POST.get("password")
    )
    if user is None:
        return HttpResponse("no", status=401)
    login(request, user)
    return HttpResponse("signed in")


def home(request):
    return HttpResponse("the project's own page")


urlpatterns = [path("login/", sign_in), path("", home)]
