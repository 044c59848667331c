from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("verification", "0004_strike_failures"),
    ]

    operations = [
        migrations.RemoveConstraint(model_name="strike", name="strike_has_evidence"),
        migrations.AddConstraint(
            model_name="strike",
            constraint=models.CheckConstraint(
                condition=models.Q(challenge__isnull=False)
                | models.Q(audit__isnull=False)
                | models.Q(job__isnull=False)
                | models.Q(kind="capacity"),
                name="strike_has_evidence",
            ),
        ),
    ]
