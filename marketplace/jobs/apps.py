from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "marketplace.jobs"
    label = "jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Once the registry is ready: an app's module is imported before Django is set up.
        from marketplace import metrics
        from worker_agent.cpu import MODEL_CPU

        MODEL_CPU.listen(metrics.record_model_cpu)  # the model's CPU, apart from the control plane's own
