from django.contrib import admin
from django.urls import path

from .shop import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("orders/<str:order_id>/<str:using>/", views.place_order),
]
