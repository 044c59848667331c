from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("verification", "0003_strike_capacity"),
    ]

    operations = [
        migrations.AlterField(
            model_name="strike",
            name="kind",
            field=models.CharField(
                choices=[
                    ("challenge", "failed challenge"),
                    ("audit", "failed audit"),
                    ("receipt", "unverifiable receipt"),
                    ("capacity", "false capacity claim"),
                    ("failures", "repeated failures"),
                ],
                max_length=16,
            ),
        ),
    ]
