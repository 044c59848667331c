"""Flows: the use cases that span several apps, each in one module.

- ``admission``: a request's jobs admitted onto ready routes, with the hold on the customer's credit;
- ``runner`` and ``tasks``: a job's coordinator run, its heals, failures and strikes, and its settlement;
- ``settlement``: a job's money (hold, re-verification of its receipts, charge, providers' shares);
- ``offerings``: a catalog entry with its prices, and placement following it;
- ``stripe_events``: a verified Stripe event applied once, to billing or payouts.

A flow calls the apps' services and selectors; no app imports a flow (``.importlinter``): the edges
(``api``, ``web``, the Django admin, the periodic work) call flows, and flows call the apps.
"""
