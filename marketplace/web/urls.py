from django.urls import path

from marketplace.web import admin_views, views

app_name = "web"

urlpatterns = [
    path("provider/nodes/", views.nodes, name="nodes"),
    path("provider/nodes/<int:pk>/", views.node_detail, name="node"),
    path("provider/nodes/<int:pk>/status/", views.node_status_fragment, name="node-status"),
    path("provider/nodes/<int:pk>/row/", views.node_row_fragment, name="node-row"),
    path("provider/nodes/<int:pk>/trust/", views.node_trust_fragment, name="node-trust"),
    path("provider/nodes/<int:pk>/rotate-token/", views.node_rotate_token, name="node-rotate-token"),
    path("provider/nodes/<int:pk>/drain/", views.node_drain, name="node-drain"),
    path("provider/earnings/", views.earnings, name="earnings"),
    path("provider/earnings/connect/", views.connect_stripe, name="connect-stripe"),
    path("customer/keys/", views.keys, name="keys"),
    path("customer/keys/<int:pk>/revoke/", views.key_revoke, name="key-revoke"),
    path("customer/billing/", views.billing_page, name="billing"),
    path("customer/billing/balance/", views.balance_fragment, name="balance"),
    path("customer/billing/top-up/", views.top_up, name="top-up"),
    path("customer/usage/", views.usage, name="usage"),
    path("customer/playground/", views.playground, name="playground"),
    path("customer/playground/chat/", views.playground_chat, name="playground-chat"),
    path("customer/playground/jobs/<str:public_id>/", views.playground_job, name="playground-job"),
    path("swarm/", admin_views.swarm, name="swarm"),
    path("swarm/health/", admin_views.swarm_health_fragment, name="swarm-health"),
    path("swarm/latency/", admin_views.latency_fragment, name="swarm-latency"),
    path("swarm/throughput/", admin_views.throughput_fragment, name="swarm-throughput"),
    path("swarm/nodes/<int:pk>/eject/", admin_views.node_eject, name="node-eject"),
    path("swarm/nodes/<int:pk>/reinstate/", admin_views.node_reinstate, name="node-reinstate"),
    path("swarm/strikes/", admin_views.strikes, name="strikes"),
    path("swarm/strikes/<int:pk>/uphold/", admin_views.strike_uphold, name="strike-uphold"),
    path("swarm/strikes/<int:pk>/overturn/", admin_views.strike_overturn, name="strike-overturn"),
    path("swarm/payouts/", admin_views.payouts, name="payouts"),
    path("swarm/payouts/build/", admin_views.payouts_build, name="payouts-build"),
    path("swarm/payouts/<int:pk>/approve/", admin_views.payouts_approve, name="payouts-approve"),
]
