"""Django's middleware whose hooks do no I/O, run on the event loop.

In an ASGI process Django runs a ``MiddlewareMixin`` middleware's ``process_request`` and
``process_response`` each in a thread (``sync_to_async``), so every request passes to a thread and
back twice per such middleware. Security headers, the common URL rules and the frame option read
the request and settings and set headers: nothing there blocks, so they run inline here, and the
hops are saved on every request (on the inference API's path to its first token, among others).
"""

from __future__ import annotations

from django.middleware import clickjacking, common, security


class _OnTheLoop:
    """``MiddlewareMixin.__acall__`` with the hooks called directly rather than in a thread."""

    async def __acall__(self, request):
        response = self.process_request(request) if hasattr(self, "process_request") else None
        response = response or await self.get_response(request)
        if hasattr(self, "process_response"):
            response = self.process_response(request, response)
        return response


class SecurityMiddleware(_OnTheLoop, security.SecurityMiddleware):
    pass


class CommonMiddleware(_OnTheLoop, common.CommonMiddleware):
    pass


class XFrameOptionsMiddleware(_OnTheLoop, clickjacking.XFrameOptionsMiddleware):
    pass
