from django.urls import path

from .shop import views

urlpatterns = [path("orders/<str:order_id>/<str:using>/", views.place_order)]
