"""Django's command line for the shop: ``python -m example_project.django_shop.manage migrate``."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.django_shop.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
