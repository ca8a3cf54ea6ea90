"""The shop's URLs: the orders API and the admin (celery-outbox's dashboard among its pages)."""

from django.contrib import admin
from django.urls import path

from .orders import views

urlpatterns = [
    path("orders", views.place_order),
    path("orders/<uuid:order_id>", views.get_order),
    path("stats", views.stats),
    path("admin/", admin.site.urls),
]
